"""``Conventions.train_simplified_str`` (the report's ``flops.train = 6*B*S*(P) + remainder`` line):
the text parses back to 6·B·S·P + remainder whatever the remainder's signs (an encoder-decoder's
remainder starts with a negative term: -36*B*D*H*L*M*S + 36*B*D*H*L*M*S_enc + ..., printed as
"+ -36..." before), at random coefficients."""
import random

import sympy

from symcost import parse_formula
from symcost.graph.conventions import Conventions


class _Totals(Conventions):
    def __init__(self, P, rem):
        self.pinned, self._P, self._rem = {}, P, rem

    def train_simplified(self):
        B, S = sympy.symbols("B S")
        return self._P, self._rem, 6 * B * S * self._P + self._rem

    def flops(self, phase="train"):
        from symcost import SYMS

        return 6 * SYMS["B"] * SYMS["S"] * self._P + self._rem

    def token_groups(self):  # (one N·P pair: the text's head is 6*B*S*(P))
        return [(("B", "S"), self._P)]

    def tp_share(self):
        return 1

    def cp_share(self):
        return 1


def test_text_parses_back_to_six_n_p_plus_remainder_for_any_signs():
    B, S, L, M, S_enc, D = sympy.symbols("B S L M S_enc D")
    terms = [B * L * M * S, B * L * M * S_enc, B * S * M, B * S * S_enc * L, B * D * S]
    rng = random.Random(30)
    for _ in range(40):
        rem = sum(rng.choice((-1, 1)) * rng.randint(1, 50) * t for t in rng.sample(terms, rng.randint(1, 4)))
        P = rng.randint(1, 9) * L * M ** 2 + M
        text = _Totals(P, rem).train_simplified_str()
        assert "+ -" not in text and "- -" not in text, text
        assert sympy.expand(parse_formula(text) - parse_formula(str(6 * B * S * P + rem))) == 0, text
