"""What runs on the training thread: the thread and its jobs, steps, epochs and Keras `fit`,
the data position, hooks, the state hooks and services keep, divergence, the events file."""
