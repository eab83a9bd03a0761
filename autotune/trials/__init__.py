"""One trial, from the controller's side: the trial contract and its runners, the launch, the
judgement of how a trial ended."""
