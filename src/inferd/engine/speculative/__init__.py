"""Speculative decoding: cheap proposers guess the next tokens, the target model checks them all
in one forward pass, and a rejection step keeps the output distribution exactly the target's.

    ngram.py      prompt lookup: continue the latest earlier match of the sequence's own suffix
    suffix.py     suffix decoding: the request's own tokens and a shared, bounded cache of outputs
    cost.py       the cost model: step seconds by rows (measured at start), learned acceptance, and
                  how many guesses of each sequence a step verifies
    draft.py      a smaller model (or the target's first N layers) with its own paged KV cache
    rejection.py  greedy acceptance and the lossless accept/resample rule, as pure functions
"""
