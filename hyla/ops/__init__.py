"""Pure tensor functions: GLA (naive, chunked, recurrent), softmax attention, Newton-Schulz."""
