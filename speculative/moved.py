"""The module paths of speculative/ before its subpackages, kept for one release (model/moved.py)."""

from model.moved import install

install({
    "speculative.block": "speculative.verify.block",
    "speculative.tree": "speculative.verify.tree",
    "speculative.drafter": "speculative.draft.model",
    "speculative.lookup": "speculative.draft.lookup",
    "speculative.eagle": "speculative.draft.eagle",
    "speculative.tree_drafting": "speculative.draft.trees",
    "speculative.distill": "speculative.draft.distill",
    "speculative.generation": "speculative.engine.generation",
    "speculative.stats": "speculative.engine.stats",
    "speculative.gamma": "speculative.engine.gamma",
    "speculative.calls": "model.call",
    "speculative.pair": "speculative.inputs",
    "speculative.report": "speculative.cli.report",
    "speculative.server": "speculative.serving.app",
    "speculative.exact": "speculative.proofs.exact",
    "speculative.toys": "speculative.proofs.toys",
})
