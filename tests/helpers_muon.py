"""The Muon recipe the Muon tests share: Muon on the hidden matrices, AdamW on the rest.

Used by ``test_muon.py`` (against torch) and ``test_comm.py`` (Muon's exchange bytes against
``fs.plan``). The model has ``D_IN`` = 40 inputs so that every matrix's gradient has full rank
(``test_muon.py``'s docstring says why).
"""

from __future__ import annotations

import funcshard as fs

STEPS = 4
LOCAL_ROWS = 24
D_IN = 40
CLIP = 0.5
LR, ADAM_LR, WD = 0.02, 1e-2, 0.1


def is_muon(name: str, shape: tuple) -> bool:
    return len(shape) == 2 and not name.startswith("head")


def schedule(step: int) -> float:
    return fs.optim.warmup_cosine(1.0, warmup=2, total=STEPS, final=0.1)(step)


def ours() -> fs.optim.Optimizer:
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(CLIP),
        fs.optim.multi_transform(
            {
                "muon": fs.optim.muon(lambda s: LR * schedule(s), weight_decay=WD),
                "adamw": fs.optim.adamw(
                    lambda s: ADAM_LR * schedule(s), weight_decay=WD, mask=fs.optim.decay_mask
                ),
            },
            lambda name, shape: "muon" if is_muon(name, shape) else "adamw",
        ),
    )
