"""The error every checkpoint problem is reported as."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or saved as asked.

    The message names the file and the variable concerned and says what to do.
    Nothing is assigned to a model when a load raises this before assignment.
    """
