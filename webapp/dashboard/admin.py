from django.contrib import admin

from webapp.dashboard.models import ApiToken, KnobChange, Run


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "status", "step", "max_steps", "created_at")
    list_filter = ("status",)


admin.site.register(KnobChange)
admin.site.register(ApiToken)
