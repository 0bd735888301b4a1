// Compiles tests/unit/test_pch.hpp into the precompiled header the test programs reuse.
