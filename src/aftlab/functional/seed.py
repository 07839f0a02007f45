"""The Transformer of the definition (stub: being written)."""


def seed_attention(*args, **kwargs):
    raise NotImplementedError


def seed_feedforward(*args, **kwargs):
    raise NotImplementedError
