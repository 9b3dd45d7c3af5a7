// doctest's main, plus one rule: a run that executes no test case fails.
//
// CTest runs every test case as `kvs_tests --test-case=<name>`. A name that CTest cannot pass through
// intact (it splits arguments at ';') matches no case, and doctest reports success for zero cases: the
// test would "pass" without running. This listener counts the cases that ran so main can refuse that.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

namespace {

int g_cases_run = -1;  // -1: no test run happened (e.g. --list-test-cases, --help)

struct CountingListener : doctest::IReporter {
  explicit CountingListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    g_cases_run = static_cast<int>(stats.numTestCasesPassingFilters);
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace

DOCTEST_REGISTER_LISTENER("count-cases", 1, CountingListener);

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int result = context.run();
  if (result == 0 && g_cases_run == 0) {
    std::fprintf(stderr, "kvs_tests: error: no test case matched the filters, so nothing was tested "
                         "(a test name containing ';' cannot be selected by CTest)\n");
    return 1;
  }
  return result;
}
