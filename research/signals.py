"""What happens to a candidate, announced for whoever builds on research to react to.

Both are sent inside the writing transaction, so a receiver's writes commit or roll back
with it; a receiver with work for after the commit (a push, a message) registers it with
`transaction.on_commit`. research.sweeps moves its sweep on after each result; reviews
tells open pages that the review queue changed (reviews.live).
"""

from __future__ import annotations

from django.dispatch import Signal

# A result is stored: sent with `candidate` and its `sweep` (with the new `done` count).
candidate_recorded = Signal()
# A candidate has a new revision, queued to be evaluated afresh: sent with `candidate`.
candidate_revised = Signal()
