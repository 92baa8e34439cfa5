"""Theses, their evidence, the sweeps run for them, and every candidate's results.

The database is the source of truth: a sweep's events are rows here before they are
published, so a browser that missed some can be replayed them.
"""

from __future__ import annotations

from datetime import UTC

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from research.hardware import HARDWARE_CHOICES, KERNEL_DSLS, MODEL_CONTEXTS


class Evidence(models.Model):
    """A profile the thesis author uploaded, with its parsed summary."""

    uploaded_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    filename = models.CharField(max_length=255)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.PositiveBigIntegerField()
    format = models.CharField(max_length=20)
    summary = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.filename} ({self.format})"


class Thesis(models.Model):
    """An optimization idea plus the evidence for it and the fences for the agents."""

    author = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="theses"
    )
    title = models.CharField(max_length=200)
    idea = models.TextField(help_text="Markdown")
    op = models.CharField(max_length=64)
    hardware = models.CharField(max_length=16, choices=HARDWARE_CHOICES)
    model_context = models.CharField(max_length=32, choices=MODEL_CONTEXTS, default="none")
    evidence = models.ForeignKey(Evidence, null=True, blank=True, on_delete=models.PROTECT)
    required_dsl = models.CharField(max_length=16, choices=KERNEL_DSLS)
    allowed_paths = models.JSONField(default=list)
    forbidden_changes = models.TextField(blank=True)
    context_lengths = models.JSONField()
    batch_sizes = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)
    # Archived: off the dashboard and closed to new sweeps; its sweeps, candidates and
    # decisions stay as they were.
    archived_at = models.DateTimeField(null=True, blank=True)
    archived_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                    on_delete=models.PROTECT, related_name="+")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.title

    def get_absolute_url(self) -> str:
        return reverse("thesis_detail", args=[self.pk])


class Sweep(models.Model):
    class Strategy(models.TextChoices):
        GRID = "grid", "Grid"
        RANDOM = "random", "Random"
        TPE = "tpe", "Model-based (TPE)"
        AGENT = "agent", "Coding agent"
        IMPORTED = "imported", "Imported from a remote host"
        # One candidate evaluated again on a trusted worker: an imported result's check.
        VERIFY = "verify", "Verification of an imported result"
        # One waiting win evaluated again against the kernel kept since it was timed.
        RETIME = "retime", "Re-timed against a newer kept kernel"
        # One waiting win's source timed against another's, where both claim the same sizes:
        # it says which of the two is faster where, and is never kept itself.
        HEAD_TO_HEAD = "head_to_head", "Head-to-head of two waiting wins"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        PAUSED = "paused"
        CANCELLED = "cancelled"
        FINISHED = "finished"

    thesis = models.ForeignKey(Thesis, on_delete=models.CASCADE, related_name="sweeps")
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT)
    kernel = models.CharField(max_length=100)
    strategy = models.CharField(max_length=16, choices=Strategy.choices)
    budget = models.PositiveIntegerField()
    # Stops: wall-clock seconds from the start (None: no limit), and candidates in a row
    # without a better result than the best so far (None: never stop early).
    time_budget_s = models.PositiveIntegerField(null=True, blank=True)
    patience = models.PositiveIntegerField(null=True, blank=True)
    # Why the sweep ended before its budget ("cancelled by ada", "10 candidates without
    # improvement"); empty while it runs or when it ran to the end.
    stop_reason = models.CharField(max_length=200, blank=True)
    # An agent sweep: the command that edits the kernel, and the context it was given.
    agent_command = models.CharField(max_length=500, blank=True)
    context = models.TextField(blank=True)
    seed = models.BigIntegerField()
    hardware = models.CharField(max_length=16, choices=HARDWARE_CHOICES)
    queue = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    total = models.PositiveIntegerField()
    done = models.PositiveIntegerField(default=0)
    # The seq of the newest event; incremented under a row lock so seqs have no gaps.
    last_seq = models.PositiveBigIntegerField(default=0)
    # The workspace's main line when the sweep started, and the kept kernel there: every
    # candidate forks from that commit and is timed against that kernel, so its diff and
    # its measurements have the same base. Stored here so a GPU host that cannot see
    # the workspace still gets the baseline with the task.
    base_commit = models.CharField(max_length=40, blank=True)
    baseline_source = models.TextField(blank=True)
    # The kept kernel's name ("baseline", "rows_triton", …): its suffix names its DSL.
    baseline_kernel = models.CharField(max_length=100, blank=True)
    # A VERIFY sweep: the imported candidate it evaluates again.
    verifies = models.ForeignKey("Candidate", null=True, blank=True, on_delete=models.CASCADE,
                                 related_name="verifications")
    # A RETIME sweep: the stale win whose source it evaluates against today's kept kernel.
    retimes = models.ForeignKey("Candidate", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="retimings")
    # A HEAD_TO_HEAD sweep: the win whose source it times (the challenger), and the win
    # whose source it is timed against (in place of the kept kernel).
    challenger = models.ForeignKey("Candidate", null=True, blank=True, on_delete=models.CASCADE,
                                   related_name="head_to_heads_as_challenger")
    challenged = models.ForeignKey("Candidate", null=True, blank=True, on_delete=models.CASCADE,
                                   related_name="head_to_heads_as_challenged")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [("import_results", "Can import results measured outside the lab's workers")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(done__lte=models.F("total")), name="sweep_done_within_total"
            ),
            # A head-to-head names both of its wins, and only a head-to-head names any.
            models.CheckConstraint(
                condition=models.Q(strategy="head_to_head", challenger__isnull=False, challenged__isnull=False)
                | (~models.Q(strategy="head_to_head") & models.Q(challenger__isnull=True, challenged__isnull=True)),
                name="sweep_head_to_head_names_both_wins",
            ),
        ]

    def __str__(self) -> str:
        return f"sweep {self.pk} of {self.kernel}"

    def get_absolute_url(self) -> str:
        return reverse("sweep_detail", args=[self.pk])

    @property
    def progress_pct(self) -> int:
        return round(100 * self.done / self.total) if self.total else 100


class Candidate(models.Model):
    """One point of a sweep: a candidate file and what the harness found."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"
        # Refused before evaluation (an edit outside the allowed paths, the wrong DSL);
        # cancelled with its sweep before a worker took it.
        REFUSED = "refused"
        CANCELLED = "cancelled"

    sweep = models.ForeignKey(Sweep, on_delete=models.CASCADE, related_name="candidates")
    number = models.PositiveIntegerField()
    params = models.JSONField(default=dict)
    source = models.TextField()
    # What proposed it: a Sweep.Strategy value.
    proposed_by = models.CharField(max_length=16, blank=True)
    # Why it was refused before evaluation, for the sweep page.
    refusal = models.TextField(blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    verdict = models.CharField(max_length=16, blank=True)
    correct = models.BooleanField(null=True)
    geomean_speedup = models.FloatField(null=True)
    best_speedup = models.FloatField(null=True)
    error = models.TextField(blank=True)
    result = models.JSONField(null=True)
    # Where the result was measured, as the lab knows it (never as the result says):
    # research.provenance.
    provenance = models.JSONField(default=dict)
    attempts = models.PositiveIntegerField(default=0)
    # The token of the one queue message that may claim it, and when that message was
    # sent (or the candidate planned): a message that was replaced because it was lost
    # (research.recovery) claims nothing if it turns up after all.
    dispatch = models.CharField(max_length=32, blank=True)
    dispatched_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    # The candidate's commit in the kernel workspace and its branch; a revision (an
    # agent amending it) is a new commit, and decisions count only for the current one.
    commit = models.CharField(max_length=40, blank=True)
    branch = models.CharField(max_length=120, blank=True)
    revision = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["sweep_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["sweep", "number"], name="candidate_number_per_sweep")
        ]

    def __str__(self) -> str:
        return f"candidate {self.number} of sweep {self.sweep_id}"

    def get_absolute_url(self) -> str:
        return reverse("candidate_review", args=[self.pk])

    @property
    def label(self) -> str:
        """Sweep-number, as candidates are named in branches and commit messages."""
        return f"{self.sweep_id}-{self.number}"

    @property
    def workloads(self) -> list[Measurement]:
        """Per-workload results in workload order (the shape live rows carry too)."""
        return list(self.measurements.all())


class Measurement(models.Model):
    """Baseline vs candidate timing on one workload."""

    candidate = models.ForeignKey(Candidate, on_delete=models.CASCADE, related_name="measurements")
    position = models.PositiveIntegerField()
    workload = models.CharField(max_length=120)
    baseline_ms = models.FloatField(null=True)
    candidate_ms = models.FloatField(null=True)
    speedup = models.FloatField(null=True)
    speedup_lo = models.FloatField(null=True)
    speedup_hi = models.FloatField(null=True)
    p_value = models.FloatField(null=True)
    significant = models.BooleanField(default=False)

    class Meta:
        ordering = ["candidate_id", "position"]
        constraints = [
            models.UniqueConstraint(
                fields=["candidate", "workload"], name="measurement_workload_per_candidate"
            )
        ]


class GuardFinding(models.Model):
    class Status(models.TextChoices):
        PASS = "pass"
        WARN = "warn"
        FAIL = "fail"

    candidate = models.ForeignKey(Candidate, on_delete=models.CASCADE, related_name="guards")
    name = models.CharField(max_length=80)
    status = models.CharField(max_length=8, choices=Status.choices)
    detail = models.TextField(blank=True)

    class Meta:
        ordering = ["candidate_id", "id"]


class Event(models.Model):
    """One entry of a sweep's live stream (CONTRACTS §6): stored, then published."""

    sweep = models.ForeignKey(Sweep, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveBigIntegerField()
    type = models.CharField(max_length=40)
    payload = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["sweep_id", "seq"]
        constraints = [models.UniqueConstraint(fields=["sweep", "seq"], name="event_seq_per_sweep")]

    def as_message(self) -> dict:
        """The event as it is sent and replayed; `at` is when it was recorded (UTC)."""
        return {"sweep": self.sweep_id, "seq": self.seq, "type": self.type, "payload": self.payload,
                "at": self.created_at.astimezone(UTC).isoformat(timespec="seconds")}


class ApiToken(models.Model):
    """A bearer token for the JSON API (remote GPU hosts, scripts). Only its hash is kept:
    the token itself is shown once, when it is created."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    # The first characters of the token, so a person can tell their tokens apart.
    prefix = models.CharField(max_length=12)
    key_hash = models.CharField(max_length=64, unique=True)
    # A GPU host's token: it can only import results, and every result it imports names
    # this host. Blank: a person's token.
    host = models.CharField(max_length=100, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
