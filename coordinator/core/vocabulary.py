"""The closed sets a request and a deployment choose from, declared once. Flags' choices, validation,
config and the wire's strings all derive from these (`names(...)`); being `str` enums, a member equals its
wire string.

    Method("cb-pp") is Method.CB_PP      TreePolicy.HYBRID == "hybrid"      names(Verifier) == ("match", "rejection")
"""
from __future__ import annotations

import enum


class Method(str, enum.Enum):
    PP = "pp"                      # plain pipeline parallelism
    SPECPIPE = "specpipe"          # the dynamic token tree (SpecPipe, SpecPipe-DB)
    SPS = "sps"                    # a chain of draft tokens per trip
    TREE = "tree"                  # a best-first tree per trip
    PIPEINFER = "pipeinfer"        # continuous asynchronous speculation (PipeInfer)
    CB_PP = "cb-pp"                # continuous batching over the pipeline


class TreePolicy(str, enum.Enum):
    """How `specpipe` picks a micro-batch's nodes (coordinator/core/tree_select.py `TokenTree.select`)."""
    LAYER = "layer"
    BEST_FIRST = "best-first"
    HYBRID = "hybrid"


class DraftKind(str, enum.Enum):
    """Where proposals come from (coordinator/core/drafts/factory.py `build_draft`)."""
    QUANT = "quant"
    QUANT_NGRAM = "quant+ngram"
    MODEL = "model"
    NGRAM = "ngram"
    NONE = "none"


class Verifier(str, enum.Enum):
    """How sampled requests are verified (coordinator/core/verify.py)."""
    MATCH = "match"
    REJECTION = "rejection"


class StageHardware(str, enum.Enum):
    """Whether the stages compute on the draft's hardware (coordinator/core/sizing.py `Sizer`: when they do,
    plain pipelining is tried before the rule trusts its model of it)."""
    SHARED = "shared"              # one machine: `specpipe local`, `make run`; stage steps slow down while it drafts
    APART = "apart"                # their own accelerators: the Helm chart's GPU pods, the simulated clock


def names(kind: type[enum.Enum]) -> tuple[str, ...]:
    """The wire strings of a closed set, in declaration order."""
    return tuple(m.value for m in kind)


# the wire strings of each set, for flags' choices and messages (the one place they are spelled)
METHODS = names(Method)
TREE_POLICIES = names(TreePolicy)
DRAFTS = names(DraftKind)
VERIFIERS = names(Verifier)
STAGE_HARDWARE = names(StageHardware)
