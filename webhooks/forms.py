"""Forms only parse input; the services decide what may be stored."""

from __future__ import annotations

from django import forms

from webhooks.models import EVENT_CHOICES, EVENT_TYPES
from webhooks.services import MAX_URL_LENGTH


class EndpointForm(forms.Form):
    url = forms.URLField(
        label="URL", max_length=MAX_URL_LENGTH, assume_scheme="https",
        widget=forms.URLInput(attrs={"placeholder": "https://hooks.example.com/kernel-lab"}),
        help_text="Receives a signed POST (Standard Webhooks) for every event below.",
    )
    events = forms.MultipleChoiceField(
        choices=EVENT_CHOICES, initial=EVENT_TYPES, widget=forms.CheckboxSelectMultiple
    )
