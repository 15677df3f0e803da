"""A payload whose unpickling is observable: the stand-in for code a malicious message would run."""


def _explode(what):
    Bomb.exploded.append(what)


class Bomb:
    """Unpickling a ``Bomb`` appends "boom" to ``Bomb.exploded``."""
    exploded = []

    def __reduce__(self):
        return _explode, ("boom",)
