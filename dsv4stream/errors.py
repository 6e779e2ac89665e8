"""The one error type dsv4stream reports at its boundary, its few subclasses, and the one
type for bugs.

A `Dsv4Error` is a problem the user can act on. Every message is a single line: what is
wrong (naming the file, tensor or key, what was expected and what was found) and what to do
about it. The CLI prints `dsv4: <message>` and exits 2; a traceback appears only with
`--debug`. An `InternalError` is a broken invariant or an internal API used against its
contract (what an `assert` would say, but checked under `python -O` too): it is not a
Dsv4Error, so it keeps its traceback everywhere.

    Dsv4Error
        ConfigError, TokenizerError, BudgetError, UsageError, NumericsError, VerifyError,
        StoreError
        CheckpointError
            ReadError
                ShortReadError
    InternalError (a RuntimeError)
        LifetimeError
"""


class Dsv4Error(Exception):
    """Base class: a problem the user can act on."""


class ConfigError(Dsv4Error):
    """config.json is missing, malformed, or describes a model we cannot run."""


class CheckpointError(Dsv4Error):
    """Shards, index or tensors do not match what the config implies."""


class TokenizerError(Dsv4Error):
    """Tokenizer files are missing or belong to another model."""


class BudgetError(Dsv4Error):
    """The memory budget cannot hold what the run needs."""


class ReadError(CheckpointError):
    """A read from a checkpoint file (shard, packed trunk) failed: the file cannot be opened
    or the disk returned an error."""


class ShortReadError(ReadError):
    """A file ended before the bytes it should hold (truncated since it was described): the
    same class wherever the read happens (catalog, packer, trunk ring, expert store)."""


class VerifyError(Dsv4Error):
    """The independent verifier found bytes that differ from the fast read path."""


class UsageError(Dsv4Error):
    """The command line asks for something inconsistent."""


class NumericsError(Dsv4Error):
    """Logits or router scores came out NaN or infinite: some weight or scale holds NaN/inf."""


class StoreError(Dsv4Error):
    """A request the expert store cannot serve: a key it has no layout for, a closed store,
    a size it cannot have."""


class InternalError(RuntimeError):
    """A broken invariant or a misuse of an internal API: a bug in dsv4stream or its caller.
    Not a Dsv4Error: the CLI shows its traceback."""


class LifetimeError(InternalError):
    """A view or handle used after its lifetime ended (an expert released, a streamed layer
    whose ring slot moved on): its bytes may already belong to something else."""
