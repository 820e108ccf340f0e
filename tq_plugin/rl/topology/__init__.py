"""Where a step's rollouts come from: the colocated step source (``colocated``) and the
disaggregated one (``disaggregated``: rollout workers ahead of the trainer) side by side, the
one builder of the generation side both use (``build``), the exchange with the workers through
the shared store (``exchange``), the worker process (``worker``), the collector of their rows
(``collector``) and the staleness ledger (``staleness``)."""
