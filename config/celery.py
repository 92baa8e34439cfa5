"""The Celery app. Candidate evaluations go to one queue per hardware class."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("kernel_lab")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
