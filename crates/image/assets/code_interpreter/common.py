"""What several parts of the code-interpreter server use."""

import os
import time


def now_ns():
    return time.time_ns()


def default_cwd():
    home = os.path.expanduser("~")
    return home if os.path.isdir(home) else "/"


def unquoted(text):
    """A result's text as E2B's server gives it: a string's repr without its quotes."""
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


class BadRequest(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message
