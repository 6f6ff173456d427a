"""The HTML pages (views.py): the runs list with the launch form, the live run page, the report,
the fork form and the comparison; their scripts are static/dashboard/."""
