"""Plans: the :class:`~hapnb.plans.plan.Plan` value and its JSON (:mod:`~hapnb.plans.plan`), the public
``synthesize`` / ``baselines`` that make one (:mod:`~hapnb.plans.synthesis`), the discrete-event
simulator that replays it (:mod:`~hapnb.plans.simulation`), why a plan is what it is (why not, sensitivity,
what-if: :mod:`~hapnb.plans.explain`) and every strategy under one cost model
(:mod:`~hapnb.plans.comparison`). Pipelines (Ditto) have their own package, :mod:`hapnb.pipelines`."""
