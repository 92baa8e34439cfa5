"""Forms only parse and shape input; the services decide what is valid to store."""

from __future__ import annotations

from django import forms
from django.conf import settings

from research.evidence import EvidenceError, check_evidence_size
from research.hardware import HARDWARE_CHOICES, KERNEL_DSLS, MODEL_CONTEXTS
from research.models import Sweep
from research import held_uploads, proposers
from research.agents import agent_commands
from research.sweeps import MAX_SWEEP_BUDGET, MAX_SWEEP_TIME_BUDGET_S
from research.theses import Upload
from runners import ops

MAX_LIST_ITEMS = 64


# Context lengths are said in binary thousands: "32K" is 32,768 tokens, "1M" 1,048,576.
_SUFFIXES = {"k": 2**10, "m": 2**20}


class IntListField(forms.CharField):
    """Comma- or space-separated positive integers, e.g. "4096, 32768" or "4K, 32K"."""

    def to_python(self, value: str | None) -> list[int]:
        text = (super().to_python(value) or "").replace(",", " ")
        items = text.split()
        if len(items) > MAX_LIST_ITEMS:
            raise forms.ValidationError(f"at most {MAX_LIST_ITEMS} values")
        numbers = []
        for item in items:
            digits, scale = item, 1
            if item[-1:].lower() in _SUFFIXES:
                digits, scale = item[:-1], _SUFFIXES[item[-1].lower()]
            # ASCII digits only: str.isdigit() also says yes to "²" (which int() refuses)
            # and to other scripts' digits.
            if not (digits.isascii() and digits.isdigit()) or len(digits) > 9:
                raise forms.ValidationError(f"{item[:20]!r} is not a whole number (or one with K or M)")
            numbers.append(int(digits) * scale)
        return numbers


class ThesisForm(forms.Form):
    title = forms.CharField(max_length=200)
    idea = forms.CharField(widget=forms.Textarea(attrs={"rows": 8}), max_length=20000,
                           help_text="Markdown. What waste did the profile show, and what is the fix?")
    op = forms.ChoiceField(label="Target op")
    hardware = forms.ChoiceField(choices=HARDWARE_CHOICES, label="Hardware target")
    model_context = forms.ChoiceField(choices=MODEL_CONTEXTS, initial="none")
    evidence = forms.FileField(required=False, label="Profile evidence",
                               help_text="PyTorch profiler trace (JSON, .json.gz), Nsight Compute "
                                         "--csv --page details, or Nsight Systems stats CSV.")
    required_dsl = forms.ChoiceField(choices=KERNEL_DSLS, label="Required kernel DSL")
    allowed_paths = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                    max_length=4000,
                                    help_text="Paths an agent may change, one per line.")
    forbidden_changes = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                        max_length=4000)
    context_lengths = IntListField(required=False, max_length=1000,
                                   help_text="e.g. 4K, 32K (K is 1,024). Blank for the op's defaults.")
    batch_sizes = IntListField(required=False, max_length=1000,
                               help_text="Blank for the op's defaults.")

    # The hidden field that names a profile held from a refused submit (held_uploads).
    HELD_FIELD = "evidence_held"

    def __init__(self, *args, user_id: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["op"].choices = [(name, name) for name in ops.list_ops()]
        self.user_id = user_id
        self.held: held_uploads.Held | None = None
        self._held_token = ""

    def clean_evidence(self) -> Upload | None:
        upload = self.cleaned_data.get("evidence")
        token = self.data.get(self.HELD_FIELD, "") if self.user_id is not None else ""
        if not upload and token:
            held = held_uploads.redeem(self.user_id, token)
            if held is None:
                raise forms.ValidationError(
                    "the profile kept from your last submit is no longer held (it waits half an hour, "
                    "and only the latest): "
                    "choose the file again")
            self._held_token = token
            return held
        if not upload:
            return None
        try:
            check_evidence_size(upload.size, max_bytes=settings.EVIDENCE_MAX_BYTES)
        except EvidenceError as error:
            raise forms.ValidationError(str(error)) from error
        return Upload(name=upload.name, data=upload.read())

    def clean_allowed_paths(self) -> list[str]:
        return [line.strip() for line in self.cleaned_data["allowed_paths"].splitlines() if line.strip()]

    def hold_evidence(self) -> None:
        """After a refusal that was not the profile's fault: keep it for the next submit."""
        upload = self.cleaned_data.get("evidence") if hasattr(self, "cleaned_data") else None
        if not upload or self.user_id is None or self.has_error("evidence"):
            return
        if not held_uploads.may_hold(upload):
            self.add_error("evidence", f"not kept for the next submit (over "
                                       f"{held_uploads.MAX_HELD_BYTES // 2**20} MB): choose it again")
            return
        self.held = (held_uploads.Held(self._held_token, upload.name, len(upload.data)) if self._held_token
                     else held_uploads.hold(self.user_id, upload))

    def release_evidence(self) -> None:
        if self._held_token:
            held_uploads.release(self.user_id, self._held_token)


class ThesisEditForm(forms.Form):
    """What the author may rewrite before the first sweep."""
    title = forms.CharField(max_length=200)
    idea = forms.CharField(widget=forms.Textarea(attrs={"rows": 8}), max_length=20000)
    forbidden_changes = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                        max_length=4000)


class ApiTokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What will use it: a script, a laptop, a GPU host.")
    host = forms.CharField(required=False, max_length=100, label="GPU host",
                           help_text="Only for a GPU host's token: it can import results and nothing "
                                     "else, and every result it imports names this host.")


class SweepForm(forms.Form):
    kernel = forms.ChoiceField()
    strategy = forms.ChoiceField(
        choices=[(value, label) for value, label in Sweep.Strategy.choices if value in proposers.STRATEGIES],
        initial=Sweep.Strategy.GRID,
        help_text="Grid and random plan every point at the start; TPE proposes from the results so far; "
                  "a coding agent edits the kernel, one proposal at a time.")
    budget = forms.IntegerField(min_value=1, max_value=MAX_SWEEP_BUDGET, initial=8,
                                help_text="Number of candidates.")
    hardware = forms.ChoiceField(choices=HARDWARE_CHOICES, label="Hardware queue")
    time_budget_s = forms.IntegerField(required=False, min_value=1, max_value=MAX_SWEEP_TIME_BUDGET_S,
                                       label="Time budget (s)",
                                       help_text="Blank for none. Queued candidates are cancelled once it is spent.")
    patience = forms.IntegerField(required=False, min_value=1, max_value=MAX_SWEEP_BUDGET,
                                  help_text="Stop after this many candidates in a row without a better "
                                            "geomean speedup. Blank: never stop early.")

    agent_command = forms.ChoiceField(
        required=False, label="Agent command",
        help_text="For a coding-agent sweep: one of the commands declared in AGENT_COMMANDS_FILE.")

    def __init__(self, *args, kernels: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["kernel"].choices = [(k, k) for k in kernels]
        # Only commands an administrator declared can run: the form offers their names.
        commands = agent_commands()
        self.fields["agent_command"].choices = [("", "—"), *((name, name) for name in commands)]
        if commands:
            self.fields["strategy"].choices = [*self.fields["strategy"].choices,
                                               (Sweep.Strategy.AGENT, Sweep.Strategy.AGENT.label)]
        else:
            del self.fields["agent_command"]

    def clean(self) -> dict:
        cleaned = super().clean()
        if cleaned.get("strategy") == Sweep.Strategy.AGENT and not cleaned.get("agent_command"):
            self.add_error("agent_command", "choose the agent command this sweep runs")
        return cleaned
