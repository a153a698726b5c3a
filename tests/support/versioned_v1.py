"""test_versioned v1, kept beside v2 until its runs drain: v2 without its ``check`` step."""

from .versioned import versioned

versioned_v1 = versioned.derive(version=1, without=["check"])
