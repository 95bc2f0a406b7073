"""tune-h's defaults, in a module of constants only: `dilococtl tune-h --help` shows them without
importing the sync model, the spec and the trainer's config."""

DEFAULT_BUDGET = 0.1  # the largest share of a round that sync may take (tune-h --budget)
DEFAULT_MAX_H = 1000  # the largest H tune-h chooses (tune-h --max-h)
DEFAULT_PORT = 29580  # probe server port (outside the run's lighthouse/base ports by default)
FEW_ROUNDS = 10  # tune-h notes a run of fewer outer rounds at its H: the sites then average too seldom to
# track one cluster (simulator, tiny, 1000 steps per site: 2 rounds 1.11-1.13x DDP's perplexity, 10 rounds
# 1.08-1.09x, 50 rounds 1.03-1.07x; BENCHMARKS.md, "Quality of every sync mode")
