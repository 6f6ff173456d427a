from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from webapp.dashboard.models import ApiToken


class Command(BaseCommand):
    help = "Create an API token for USER and print its key (send it as 'Authorization: Token <key>')."

    def add_arguments(self, parser):
        parser.add_argument("user")

    def handle(self, *args, **opts):
        User = get_user_model()
        try:
            user = User.objects.get(**{User.USERNAME_FIELD: opts["user"]})
        except User.DoesNotExist:
            raise CommandError(f"no user {opts['user']!r}") from None
        self.stdout.write(ApiToken.objects.create(user=user).key)
