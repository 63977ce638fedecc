"""Expert streaming for Mixture-of-Experts models: store, bounded cache, predictor, prefetcher."""
