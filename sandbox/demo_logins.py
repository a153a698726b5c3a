"""The demo's logins (DJANGO_DEBUG only): the users ``demo`` (superuser), ``supervisor``,
``operator`` and ``viewer`` share one password, generated once per checkout and kept in
``var/demo-password`` (mode 0600), so that it passes the password validators like every other,
is nobody else's, and stays the same across restarts (an open session is not logged out)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model

from recovery.accounts import ROLES, check_password_strength, generated_password

SUPERUSER = "demo"
USERS = (SUPERUSER, *ROLES)
REASON = "the demo's logins (DJANGO_DEBUG): var/demo-password"


def password_file() -> Path:
    return Path(settings.VAR_DIR) / "demo-password"


def demo_password() -> str:
    """This checkout's demo password: read from var/demo-password, or generated and written
    there first (atomically: two processes starting at once agree on one)."""
    path = password_file()
    if not path.exists():
        User = get_user_model()
        password = _strong_for_all(lambda: generated_password(user=User(username=SUPERUSER)))
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".demo-password-")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(password + "\n")
            os.link(temporary, path)  # fails if another process wrote it first: theirs stands
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    return path.read_text().strip()


def _strong_for_all(draw) -> str:
    User = get_user_model()
    while True:
        password = draw()
        try:
            for name in USERS:
                check_password_strength(password, user=User(username=name))
        except ValueError:
            continue
        return password
