"""Engram (DeepSeek-V4.1): n-gram hash lookups that add table rows into the residual streams.

``vocab`` (token id -> compressed class, the normalisation rules) -> ``layout`` (each hash
column's prime bucket and offset in its layer's table, the table's rows: what config
validation checks) -> ``hashing`` (pinned multipliers; row ids for a whole sequence or one
token at a time).
Pure integer arithmetic over numpy arrays: no file or thread lives here.
"""

from .hashing import HashLayout, History, hash_multipliers, next_row_ids, row_ids
from .vocab import TokenClasses, check_class_count, token_classes

__all__ = [
    "HashLayout",
    "History",
    "TokenClasses",
    "check_class_count",
    "hash_multipliers",
    "next_row_ids",
    "row_ids",
    "token_classes",
]
