// The translation unit zinf_test_pch compiles with the test binaries' precompiled headers
// (tests/CMakeLists.txt); it holds no test.
