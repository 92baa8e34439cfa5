"""Keep, revert or undo a keep: a person's decision on one revision of a candidate.

Decisions are append-only: undoing a keep is a row of its own that names the keep it
undoes, and the keep's row stays, so the path shows both.

Four eyes are kept by the database, not only by the service: a review row names its
reviewer next to the thesis author and the candidate's producer (who started the
sweep), and check constraints refuse a row where the reviewer is either of them.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from research.models import Candidate
from runners.harness.dispatch import axis_name

# Who may keep or revert a candidate, and ask a worker to verify an imported one.
DECIDE_PERMISSION = "reviews.decide_candidate"


class UnverifiedKeepRequest(models.Model):
    """A reviewer asks to keep an imported win that no worker of the lab has verified (its
    hardware class may have none). Only a second reviewer's confirmation keeps it, and the
    keep stays marked unverified: on the review, the path chart and the dispatch table."""

    candidate = models.ForeignKey(Candidate, on_delete=models.CASCADE, related_name="unverified_requests")
    revision = models.PositiveIntegerField()
    commit = models.CharField(max_length=40)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    comment = models.TextField(blank=True)
    dispatch_min = models.PositiveBigIntegerField(null=True, blank=True)
    dispatch_max = models.PositiveBigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["candidate", "revision"],
                                               name="unverified_keep_one_request_per_revision")]

    def __str__(self) -> str:
        return f"keep {self.candidate} unverified, asked by {self.requested_by}"


class Review(models.Model):
    class Decision(models.TextChoices):
        KEEP = "keep", "Kept"
        REVERT = "revert", "Reverted"
        UNDO = "undo", "Undone"

    candidate = models.ForeignKey(Candidate, on_delete=models.CASCADE, related_name="reviews")
    # The revision decided on: a new commit of the candidate dismisses this decision.
    commit = models.CharField(max_length=40, blank=True)
    revision = models.PositiveIntegerField()
    decision = models.CharField(max_length=8, choices=Decision.choices)
    reviewer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                                 related_name="reviews_given")
    author = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    producer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    comment = models.TextField(blank=True)
    # Where the kept kernel serves (inclusive, along the op's size axis); null: everywhere.
    dispatch_axis = models.CharField(max_length=40, blank=True)
    dispatch_min = models.PositiveBigIntegerField(null=True, blank=True)
    dispatch_max = models.PositiveBigIntegerField(null=True, blank=True)
    merge_commit = models.CharField(max_length=40, blank=True)
    archived_branch = models.CharField(max_length=120, blank=True)
    # A keep of an imported win no worker verified: the first reviewer's request, which
    # this review (by another reviewer) confirmed.
    unverified_request = models.OneToOneField(UnverifiedKeepRequest, null=True, blank=True,
                                              on_delete=models.PROTECT, related_name="review")
    # An undo: the keep it undoes (one undo per keep), and the commit on main that
    # restored the kernel from before that keep.
    undoes = models.OneToOneField("self", null=True, blank=True, on_delete=models.PROTECT,
                                  related_name="undone_by")
    revert_commit = models.CharField(max_length=40, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [("decide_candidate", "Can keep or revert a candidate")]
        constraints = [
            models.CheckConstraint(condition=~Q(reviewer=F("author")), name="review_reviewer_is_not_author"),
            models.CheckConstraint(condition=~Q(reviewer=F("producer")), name="review_reviewer_is_not_producer"),
            # Keep or revert once per revision; an undo comes after its keep, on the same revision.
            models.UniqueConstraint(fields=["candidate", "revision"], condition=~Q(decision="undo"),
                                    name="review_one_decision_per_revision"),
            models.CheckConstraint(condition=Q(decision__in=["keep", "revert", "undo"]),
                                   name="review_decision_known"),
            models.CheckConstraint(condition=Q(decision="undo", undoes__isnull=False)
                                   | (~Q(decision="undo") & Q(undoes__isnull=True)),
                                   name="review_undo_names_its_keep"),
            models.CheckConstraint(
                condition=Q(dispatch_min__isnull=True) | Q(dispatch_max__isnull=True)
                | Q(dispatch_min__lte=F("dispatch_max")),
                name="review_dispatch_range_ordered",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.get_decision_display()} {self.candidate} (r{self.revision}) by {self.reviewer}"

    @property
    def is_keep(self) -> bool:
        return self.decision == self.Decision.KEEP

    @property
    def is_undo(self) -> bool:
        return self.decision == self.Decision.UNDO

    @property
    def dispatch_text(self) -> str:
        if self.dispatch_min is None and self.dispatch_max is None:
            return "every size"
        axis = axis_name(self.dispatch_axis)
        low = "…" if self.dispatch_min is None else f"{self.dispatch_min:,}"
        high = "…" if self.dispatch_max is None else f"{self.dispatch_max:,}"
        return f"{axis} {low}–{high}"


class CompoundRun(models.Model):
    """One measurement of a hardware class's "kernels compound" waterfall: the decode
    loop's tokens per second with the kept kernels stacked in, one stage per keep or
    undo (reviews.compounding). Asked for after every keep and undo, measured by a
    worker of that class (its queue), one run per head of main."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        DONE = "done", "Measured"
        FAILED = "failed", "Failed"

    hardware = models.CharField(max_length=16)
    # Main's head when it was asked for: the stages are its history.
    main_commit = models.CharField(max_length=40)
    queue = models.CharField(max_length=64)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.QUEUED)
    # One harness report a loop (runners.harness.compound), with each stage's commit.
    reports = models.JSONField(default=list, blank=True)
    error = models.TextField(blank=True)
    provenance = models.JSONField(default=dict, blank=True)
    requested_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["hardware", "main_commit"],
                                               name="compound_one_run_per_head")]

    def __str__(self) -> str:
        return f"waterfall of {self.hardware} at {self.main_commit[:12]} ({self.status})"
