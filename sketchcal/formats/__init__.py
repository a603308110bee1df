"""On-disk formats, each in one module beside its writer and reader (``stats``: the statistics directory)."""
