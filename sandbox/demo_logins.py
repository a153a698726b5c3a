"""The demo's logins (DJANGO_DEBUG only): the users ``demo`` (superuser), ``supervisor``,
``operator`` and ``viewer`` share one password, generated once per checkout and kept in
``var/demo-password`` (mode 0600), so that it passes the password validators like every other,
is nobody else's, and stays the same across restarts (an open session is not logged out)."""

from __future__ import annotations

import hashlib
import json
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


def _verified_file() -> Path:
    return Path(settings.VAR_DIR) / "demo-password.verified"


def verified(username: str) -> str:
    """The stored hash ``username`` had when it was last seen to match this checkout's demo
    password ("" if none, or if the password has changed since): a warm restart does not derive
    four keys again to learn that nothing changed (recovery.accounts._same_password)."""
    return _verified_hashes().get(username, "")


def remember(user) -> None:
    """Note ``user``'s stored hash as matching the demo password (mode 0600, beside the password);
    nothing is written when it is noted already."""
    hashes = _verified_hashes()
    if hashes.get(user.get_username()) == user.password:
        return
    hashes[user.get_username()] = user.password
    path = _verified_file()
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".demo-password-verified-")
    with os.fdopen(fd, "w") as out:
        json.dump({"password": _fingerprint(), "hashes": hashes}, out)
    os.replace(temporary, path)


def _verified_hashes() -> dict[str, str]:
    """Username -> the stored hash seen matching the current demo password ({} if the file is
    missing, unreadable, or about another password)."""
    try:
        known = json.loads(_verified_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict) or known.get("password") != _fingerprint():
        return {}
    hashes = known.get("hashes")
    if not isinstance(hashes, dict):
        return {}
    return {name: found for name, found in hashes.items() if isinstance(found, str)}


def _fingerprint() -> str:
    return hashlib.sha256(demo_password().encode()).hexdigest()


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
