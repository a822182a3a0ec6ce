"""Everything resolved before any worker starts: settings (sections, loading, validation), the
run plan with every check, and the memory estimate. Never imports train/ or infer/."""
