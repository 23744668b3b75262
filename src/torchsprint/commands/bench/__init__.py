"""`torchsprint bench`: the variant matrix, measuring one variant, the report."""
