"""The one exception type that command-line tools turn into a one-line message and exit code 2."""


class UserError(Exception):
    """Bad input from the user: an unknown model, a missing file or package, an invalid plan.

    The message is the whole story (it names the fix), so the CLIs print it without a traceback.
    """
