"""Training scripts (the S3D mask-token objective lands here with the training issue)."""
