"""``manage.py create_api_token USERNAME NAME [--host HOST]``: a token for the JSON API, printed once.

With --host, a GPU host's token: it can only import results, and each one names HOST."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from research.api_tokens import api_token_create

USAGE_ERROR = 2


class Command(BaseCommand):
    help = "Create an API token for a user and print it (only its hash is kept: it is shown once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("name", help="what will use it, e.g. the GPU host's name")
        parser.add_argument("--host", default="", help="make it a GPU host's token: it can only import "
                                                       "results, and each result names this host")

    def handle(self, *args: Any, username: str, name: str, host: str, **options: Any) -> None:
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}", returncode=USAGE_ERROR)
        try:
            _, token = api_token_create(user=user, name=name, host=host)
        except ValidationError as error:
            raise CommandError("; ".join(sum(error.message_dict.values(), [])), returncode=USAGE_ERROR) from error
        self.stdout.write(token)
