"""The one kind of error a user can fix.

Every script catches UserError in one place, prints its message as one paragraph after the
script's name and exits 1. Anything else is a bug in ddpgpt and keeps its traceback.
"""


class UserError(Exception):
    """Bad input or a bad state that the user can fix. The message names the file, key or
    value, says what is wrong with it and what to do."""
