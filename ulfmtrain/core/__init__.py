"""Layer 1, the vocabulary: the modes and policies (enums), the errors, and small leaf helpers.

modes (every mode and policy, defined once; UsageError), atomic (atomic files), framing (checksummed frames),
events (the ranks' JSON-lines logs), extras (optional dependencies), refusal (one line, then SystemExit).

The rule: a module here imports nothing of ulfmtrain's (the layers, lowest first, are ulfmtrain._LAYERS).
"""
