"""How thoroughly the suite runs: conftest sets SLOW from pytest's ``--slow`` before any test module is
imported. The default run keeps a few examples of each property test (the README's test command
stays a few minutes on two cores); ``--slow``, which CI runs too, the full count."""

SLOW = False


def property_examples(full: int) -> int:
    """hypothesis max_examples: `full` with --slow, else a fifth of it (at least 3)."""
    return full if SLOW else max(3, full // 5)
