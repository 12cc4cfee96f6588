"""The one error type of the data package."""


class DataError(ValueError):
    """Bad training data: a missing or malformed shard, a token id out of range, too little text.

    The message names the file or value at fault and what was expected.
    """
