"""The end-to-end check: a synthetic decode step that dispatches the op under test."""
