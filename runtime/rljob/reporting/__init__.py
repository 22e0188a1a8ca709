"""What processes tell the world: RLJob status (`reporter`), metrics.jsonl and curves,
experiment trackers, Prometheus metrics of workers, the progress bar, and where an actor
runs (`locatable`)."""
