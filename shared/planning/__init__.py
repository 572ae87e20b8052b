"""HAT's planning as pure functions: the state model and its moving averages, the cloud's compute delay g(mu),
device speed classes, the chunk-size and parallel-draft planners, and the draft budget of a round."""
