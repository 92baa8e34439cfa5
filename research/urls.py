from __future__ import annotations

from django.urls import path

from research import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("theses/new/", views.thesis_new, name="thesis_new"),
    path("theses/<int:thesis_id>/", views.thesis_detail, name="thesis_detail"),
    path("theses/<int:thesis_id>/sweeps/", views.sweep_start, name="sweep_start"),
    path("theses/<int:thesis_id>/edit/", views.thesis_edit, name="thesis_edit"),
    path("theses/<int:thesis_id>/archive/", views.thesis_archive, {"archived": True}, name="thesis_archive"),
    path("theses/<int:thesis_id>/restore/", views.thesis_archive, {"archived": False}, name="thesis_restore"),
    path("sweeps/<int:sweep_id>/", views.sweep_detail, name="sweep_detail"),
    path("sweeps/<int:sweep_id>/results/", views.sweep_results, name="sweep_results"),
    path("sweeps/<int:sweep_id>/pause/", views.sweep_control_action, {"action": "pause"}, name="sweep_pause"),
    path("sweeps/<int:sweep_id>/resume/", views.sweep_control_action, {"action": "resume"}, name="sweep_resume"),
    path("sweeps/<int:sweep_id>/cancel/", views.sweep_control_action, {"action": "cancel"}, name="sweep_cancel"),
    path("sweeps/<int:sweep_id>/events.json", views.sweep_events, name="sweep_events"),
    path("sweeps/<int:sweep_id>/chart.json", views.sweep_chart, name="sweep_chart"),
    path("candidates/<int:candidate_id>/export.zip", views.candidate_export, name="candidate_export"),
    path("skills/<path:pack>", views.skill_pack, name="skill_pack"),
    path("tokens/", views.api_token_list, name="api_token_list"),
    path("tokens/<int:token_id>/revoke/", views.api_token_revoke, name="api_token_revoke"),
]
