"""Speculative decoding: cheap proposers guess the next tokens, the target model checks them all
in one forward pass, and a rejection step keeps the output distribution exactly the target's.

    proposal.py   `Draft`, what every proposer returns, and `Proposer`, the hooks the decoder calls
    ngram.py      prompt lookup: continue the latest earlier match of the sequence's own suffix
    suffix.py     suffix decoding: the request's own tokens and a shared, bounded cache of outputs
    cost.py       the cost model: step seconds by rows (measured at start), learned acceptance, and
                  the guesses that maximise a step's expected tokens per second
    budget.py     how many of each draft's guesses a step verifies: the cost model's choice (with the
                  grammar's cut and the count of where every guess went), or every guess
    draft.py      a smaller model (or the target's first N layers) with its own paged KV cache
    rejection.py  greedy acceptance and the lossless accept/resample rule, as pure functions
    decoder.py    `SpecDecoder`: propose, budget, verify inside the engine's step, whatever the method
"""
