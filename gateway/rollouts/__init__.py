"""Model rollouts: weighted alias arms, sticky per end user, live weights in the identity store, and automatic
rollback of an arm that regresses against the stable one (docs/rollouts.md)."""
