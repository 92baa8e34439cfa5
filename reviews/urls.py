from __future__ import annotations

from django.urls import path

from reviews import views

urlpatterns = [
    path("reviews/", views.review_queue, name="review_queue"),
    path("candidates/<int:candidate_id>/", views.candidate_review, name="candidate_review"),
    path("candidates/<int:candidate_id>/source/", views.candidate_source, name="candidate_source"),
    path("candidates/<int:candidate_id>/decide/", views.candidate_decide, name="candidate_decide"),
    path("candidates/<int:candidate_id>/verify/", views.candidate_verify, name="candidate_verify"),
    path("candidates/<int:candidate_id>/retime/", views.candidate_retime, name="candidate_retime"),
    path("candidates/<int:candidate_id>/compare/", views.candidate_compare_pick, name="candidate_compare_pick"),
    path("candidates/<int:candidate_id>/compare/<int:other_id>/", views.candidate_compare,
         name="candidate_compare"),
    path("candidates/<int:candidate_id>/compare/<int:other_id>/head-to-head/", views.candidate_head_to_head,
         name="candidate_head_to_head"),
    path("ops/<str:op>/", views.op_detail, name="op_detail"),
    path("theses/<int:thesis_id>/path/", views.thesis_path, name="thesis_path"),
    path("path/", views.path_team, name="path_team"),
    path("path/compound/", views.path_compound, name="path_compound"),
    path("leaderboard/", views.leaderboard, name="leaderboard"),
]
