"""The one exception type users see: its message is printed as a single line, never a traceback."""


class FafoError(Exception):
    """A problem with the user's input or environment, explained in one line."""
