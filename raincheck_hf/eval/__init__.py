"""Quality evaluation: every mode × selector on multi-turn visual dialogues (`python -m raincheck_hf.eval`).

    from raincheck_hf.eval import evaluate, summarize, glyph_dialogues, load_jsonl
"""

from .data import EvalDialogue, EvalTurn, glyph_dialogues, load_jsonl
from .harness import evaluate, run_dialogue, summarize
from .scoring import SCORERS, get_scorer

__all__ = ["EvalDialogue", "EvalTurn", "SCORERS", "evaluate", "get_scorer", "glyph_dialogues", "load_jsonl",
           "run_dialogue", "summarize"]
