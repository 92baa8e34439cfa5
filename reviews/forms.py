"""Forms only parse and shape input; the services decide what may be stored."""

from __future__ import annotations

from django import forms

from reviews.models import Review
from reviews.selectors import LEADERBOARD_PERIODS
from reviews.services import MAX_COMMENT


class QueueFilterForm(forms.Form):
    op = forms.ChoiceField(required=False)
    hardware = forms.ChoiceField(required=False)
    author = forms.TypedChoiceField(required=False, coerce=int, empty_value=None)
    thesis = forms.TypedChoiceField(required=False, coerce=int, empty_value=None)
    mine = forms.BooleanField(required=False, label="Reviewable by me",
                              help_text="Hide what you filed or produced.")

    def __init__(self, *args, choices: dict[str, list], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, options in choices.items():
            self.fields[name].choices = [("", f"any {name}")] + [(str(k), v) for k, v in options]

    def filters(self, user) -> dict:
        """The valid filters; an unknown value filters nothing rather than failing the page."""
        self.is_valid()
        found = {name: value for name, value in self.cleaned_data.items() if value}
        if found.pop("mine", False):
            found["reviewable_by"] = user
        return found


class DecisionForm(forms.Form):
    # Beside keep and revert, for an imported win no worker verified: ask to keep it
    # unverified, or confirm another reviewer's request (reviews.services).
    ASK_UNVERIFIED, CONFIRM_UNVERIFIED = "ask-unverified", "confirm-unverified"
    decision = forms.ChoiceField(choices=[*Review.Decision.choices,
                                          (ASK_UNVERIFIED, "Ask to keep unverified"),
                                          (CONFIRM_UNVERIFIED, "Confirm keeping unverified")])
    commit = forms.CharField(required=False, max_length=40, widget=forms.HiddenInput)
    comment = forms.CharField(required=False, max_length=MAX_COMMENT,
                              widget=forms.Textarea(attrs={"rows": 3}),
                              help_text="Why: what you checked, what worried you.")
    dispatch_min = forms.IntegerField(required=False, min_value=1, label="Dispatch from",
                                      help_text="Blank: from the smallest size.")
    dispatch_max = forms.IntegerField(required=False, min_value=1, label="Dispatch up to",
                                      help_text="Blank: to the largest size.")
    saw_hidden_characters = forms.BooleanField(
        required=False, label="I have read the hidden characters the diff marks",
        help_text="Needed to keep a change that holds them.")


class LeaderboardForm(forms.Form):
    period = forms.ChoiceField(required=False, choices=[
        ("7", "7 days"), ("30", "30 days"), ("90", "90 days"), ("all", "all time"),
    ])

    def days(self) -> int | None:
        self.is_valid()
        return LEADERBOARD_PERIODS.get(self.cleaned_data.get("period") or "30", 30)
