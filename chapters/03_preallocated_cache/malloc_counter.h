#pragma once
// Counts every heap allocation the process makes (malloc, calloc, realloc, aligned allocations, and
// operator new, which calls malloc): linked into chapter 03 and the tests to show that a decode step
// allocates nothing.
namespace kvs {
long heap_allocations();
}
