from django.urls import path

from . import views

app_name = "sandbox"

urlpatterns = [
    path("tasks/", views.tasks, name="tasks"),
    path("tasks/<str:task_id>", views.task, name="task"),
    path("tasks/<str:task_id>/cancel", views.task_cancel, name="task-cancel"),
    path("tasks/<str:task_id>/decide", views.task_decide, name="task-decide"),
    path("tasks/<str:task_id>/watch", views.task_watch, name="task-watch"),
    path("messages/", views.messages, name="messages"),
    path("messages/<str:message_id>", views.message, name="message"),
    path("messages/<str:message_id>/corrections", views.message_corrections, name="message-corrections"),
    path("ledger/entries/", views.ledger_entries, name="ledger-entries"),
    path("ledger/entries/<str:entry_id>", views.ledger_entry, name="ledger-entry"),
    path("ledger/entries/<str:entry_id>/reverse", views.ledger_reverse, name="ledger-reverse"),
]
