"""{% chart_specs %}: the dashboard's chart list and histogram axes, from the trainer's one
declaration of metric names, as a JSON script element the page scripts read."""
from django import template
from django.utils.html import json_script

from trainer.observe import metric_names

register = template.Library()


@register.simple_tag
def chart_specs():
    return json_script(metric_names.page_spec(), "chart-specs")
