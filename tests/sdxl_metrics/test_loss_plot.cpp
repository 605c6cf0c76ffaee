#include "loss_plot.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "../io/temp_dir.hpp"
#include "zero/core/error.hpp"

using namespace sdxl::metrics;
using zero::io::testing::read_text;
using zero::io::testing::TempDir;

namespace {

// ---------------------------------------------------------------- minimal XML reader

struct Element {
  std::string name;
  std::map<std::string, std::string> attributes;
  std::string text;  // character data directly inside, entities decoded
};

bool is_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ':' || c == '.';
}

// Decodes the five predefined entities and numeric references; anything else
// after '&' is not well-formed.
std::string decode_entities(std::string_view text, bool& ok) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '<') ok = false;
    if (text[i] != '&') {
      out += text[i];
      continue;
    }
    const std::size_t end = text.find(';', i);
    if (end == std::string_view::npos) {
      ok = false;
      return out;
    }
    const std::string_view entity = text.substr(i + 1, end - i - 1);
    static const std::map<std::string_view, char> named = {
        {"amp", '&'}, {"lt", '<'}, {"gt", '>'}, {"quot", '"'}, {"apos", '\''}};
    if (auto it = named.find(entity); it != named.end())
      out += it->second;
    else if (entity.size() > 1 && entity[0] == '#')
      out += '?';
    else
      ok = false;
    i = end;
  }
  return out;
}

// Checks well-formedness (one root, matched and nested tags, quoted unique
// attributes, only known entities) and returns every element in document order.
std::vector<Element> parse_xml(const std::string& xml, bool& ok) {
  ok = true;
  std::vector<Element> elements;
  std::vector<std::pair<std::string, std::size_t>> open;  // name, index in elements
  std::size_t pos = 0;
  int roots = 0;
  if (xml.rfind("<?xml", 0) == 0) {
    pos = xml.find("?>");
    if (pos == std::string::npos) return ok = false, elements;
    pos += 2;
  }
  while (ok && pos < xml.size()) {
    const std::size_t lt = xml.find('<', pos);
    const std::string_view text(xml.data() + pos, (lt == std::string::npos ? xml.size() : lt) - pos);
    const std::string decoded = decode_entities(text, ok);
    if (open.empty()) {
      if (decoded.find_first_not_of(" \t\r\n") != std::string::npos) ok = false;
    } else {
      elements[open.back().second].text += decoded;
    }
    if (lt == std::string::npos) break;
    pos = lt + 1;
    if (xml.compare(pos, 3, "!--") == 0) {
      const std::size_t end = xml.find("-->", pos);
      if (end == std::string::npos) ok = false;
      pos = end + 3;
      continue;
    }
    const bool closing = xml[pos] == '/';
    if (closing) ++pos;
    std::size_t name_end = pos;
    while (name_end < xml.size() && is_name_char(xml[name_end])) ++name_end;
    const std::string name = xml.substr(pos, name_end - pos);
    if (name.empty()) return ok = false, elements;
    pos = name_end;
    if (closing) {
      while (pos < xml.size() && std::isspace(static_cast<unsigned char>(xml[pos]))) ++pos;
      if (pos >= xml.size() || xml[pos] != '>' || open.empty() || open.back().first != name)
        return ok = false, elements;
      open.pop_back();
      ++pos;
      continue;
    }
    Element element{name, {}, {}};
    bool self_closing = false;
    while (true) {
      while (pos < xml.size() && std::isspace(static_cast<unsigned char>(xml[pos]))) ++pos;
      if (pos >= xml.size()) return ok = false, elements;
      if (xml[pos] == '>') {
        ++pos;
        break;
      }
      if (xml.compare(pos, 2, "/>") == 0) {
        pos += 2;
        self_closing = true;
        break;
      }
      std::size_t attr_end = pos;
      while (attr_end < xml.size() && is_name_char(xml[attr_end])) ++attr_end;
      const std::string attr = xml.substr(pos, attr_end - pos);
      if (attr.empty() || attr_end + 1 >= xml.size() || xml[attr_end] != '=' ||
          (xml[attr_end + 1] != '"' && xml[attr_end + 1] != '\''))
        return ok = false, elements;
      const char quote = xml[attr_end + 1];
      const std::size_t value_end = xml.find(quote, attr_end + 2);
      if (value_end == std::string::npos) return ok = false, elements;
      const std::string value =
          decode_entities(std::string_view(xml).substr(attr_end + 2, value_end - attr_end - 2), ok);
      if (!element.attributes.emplace(attr, value).second) ok = false;  // duplicate attribute
      pos = value_end + 1;
    }
    if (open.empty() && ++roots > 1) ok = false;
    elements.push_back(std::move(element));
    if (!self_closing) open.emplace_back(name, elements.size() - 1);
  }
  if (!open.empty() || roots != 1) ok = false;
  return elements;
}

std::vector<Element> parse_svg(const std::string& svg) {
  bool ok = false;
  auto elements = parse_xml(svg, ok);
  REQUIRE_MESSAGE(ok, "not well-formed XML:\n" << svg.substr(0, 2000));
  REQUIRE(!elements.empty());
  CHECK(elements[0].name == "svg");
  CHECK(elements[0].attributes["xmlns"] == "http://www.w3.org/2000/svg");
  return elements;
}

struct Xy {
  double x;
  double y;
};

std::vector<Xy> polyline_points(const std::vector<Element>& elements, const std::string& css_class) {
  for (const Element& e : elements) {
    if (e.name != "polyline" || e.attributes.at("class") != css_class) continue;
    std::vector<Xy> points;
    std::istringstream in(e.attributes.at("points"));
    std::string pair;
    while (in >> pair) {
      const auto comma = pair.find(',');
      REQUIRE(comma != std::string::npos);
      points.push_back({std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1))});
    }
    return points;
  }
  FAIL("no polyline of class " << css_class);
  return {};
}

std::size_t count_named(const std::vector<Element>& elements, const std::string& name) {
  std::size_t n = 0;
  for (const Element& e : elements) n += e.name == name;
  return n;
}

bool has_text(const std::vector<Element>& elements, const std::string& text) {
  for (const Element& e : elements)
    if (e.name == "text" && e.text == text) return true;
  return false;
}

std::string text_of_class(const std::vector<Element>& elements, const std::string& css_class) {
  for (const Element& e : elements)
    if (e.name == "text" && e.attributes.count("class") && e.attributes.at("class") == css_class) return e.text;
  return {};
}

struct Series {
  std::vector<std::int64_t> steps;
  std::vector<double> losses;
};

Series decaying(std::size_t n) {
  Series s;
  for (std::size_t i = 0; i < n; ++i) {
    s.steps.push_back(static_cast<std::int64_t>(i + 1));
    s.losses.push_back(0.2 * std::exp(-0.01 * static_cast<double>(i)) + 0.02 * std::sin(0.7 * static_cast<double>(i)) + 0.05);
  }
  return s;
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("xml checker rejects what is not well-formed") {
  bool ok = false;
  parse_xml("<a><b x=\"1\"/></a>", ok);
  CHECK(ok);
  for (const char* bad : {"<a><b></a></b>", "<a>", "<a x=1/>", "<a/><b/>", "<a>&nbsp;</a>",
                          "<a x=\"1\" x=\"2\"/>", "<a>1 < 2</a>"}) {
    parse_xml(bad, ok);
    CHECK_MESSAGE(!ok, bad);
  }
}

TEST_CASE("loss chart: structure, one point per step in both lines, labels") {
  const Series s = decaying(50);
  LossPlotOptions options;
  options.title = "SDXL <fine-tune> & friends";
  LossPlotSummary summary;
  const std::string svg = render_loss_svg(s.steps, s.losses, options, &summary);
  const auto elements = parse_svg(svg);

  CHECK(polyline_points(elements, "loss").size() == 50);
  CHECK(polyline_points(elements, "ema").size() == 50);
  CHECK(summary.points == 50);
  CHECK(summary.plotted == 50);
  CHECK(summary.polyline_points == 50);
  CHECK(text_of_class(elements, "title") == "SDXL <fine-tune> & friends");  // escaped, decoded back
  CHECK(text_of_class(elements, "x-label") == "step");
  CHECK(text_of_class(elements, "y-label") == "loss");
  CHECK(text_of_class(elements, "note").empty());
  CHECK(has_text(elements, "loss"));  // legend
  CHECK(has_text(elements, "EMA (0.95)"));
  // Nice ticks: steps 1..50 on 0, 10, ..., 50 and losses 0.16..0.28 every 0.02.
  for (const char* tick : {"0", "10", "20", "30", "40", "50"}) CHECK_MESSAGE(has_text(elements, tick), tick);
  CHECK(has_text(elements, "0.16"));
  CHECK(has_text(elements, "0.28"));

  // Every point lies inside the plot frame.
  const Element* frame = nullptr;
  for (const Element& e : elements)
    if (e.name == "rect" && e.attributes.count("class") && e.attributes.at("class") == "frame") frame = &e;
  REQUIRE(frame != nullptr);
  const double fx = std::stod(frame->attributes.at("x")), fy = std::stod(frame->attributes.at("y"));
  const double fw = std::stod(frame->attributes.at("width")), fh = std::stod(frame->attributes.at("height"));
  for (const Xy& p : polyline_points(elements, "loss")) {
    CHECK(p.x >= fx - 0.1);
    CHECK(p.x <= fx + fw + 0.1);
    CHECK(p.y >= fy - 0.1);
    CHECK(p.y <= fy + fh + 0.1);
  }
  // The smoothed line is flatter than the raw one.
  auto spread = [](const std::vector<Xy>& points) {
    double lo = 1e300, hi = -1e300;
    for (const Xy& p : points) lo = std::min(lo, p.y), hi = std::max(hi, p.y);
    return hi - lo;
  };
  CHECK(spread(polyline_points(elements, "ema")) < spread(polyline_points(elements, "loss")));
}

TEST_CASE("loss chart: NaN and infinite losses are skipped and counted") {
  Series s = decaying(20);
  s.losses[3] = kNaN;
  s.losses[7] = kInf;
  s.losses[8] = -kInf;
  LossPlotSummary summary;
  const auto elements = parse_svg(render_loss_svg(s.steps, s.losses, {}, &summary));
  CHECK(summary.skipped_non_finite == 3);
  CHECK(summary.plotted == 17);
  CHECK(polyline_points(elements, "loss").size() == 17);
  CHECK(polyline_points(elements, "ema").size() == 17);
  CHECK(text_of_class(elements, "note") == "3 non-finite points skipped");
}

TEST_CASE("loss chart: empty input and a single point") {
  const auto empty = parse_svg(render_loss_svg({}, {}));
  CHECK(count_named(empty, "polyline") == 0);
  CHECK(text_of_class(empty, "no-data") == "no data");
  CHECK(text_of_class(empty, "x-label") == "step");

  const std::vector<double> all_nan = {kNaN, kNaN};
  const std::vector<std::int64_t> two_steps = {1, 2};
  const auto nothing = parse_svg(render_loss_svg(two_steps, all_nan));
  CHECK(text_of_class(nothing, "no-data") == "no data");
  CHECK(text_of_class(nothing, "note") == "2 non-finite points skipped");

  const std::vector<std::int64_t> step = {100};
  const std::vector<double> loss = {0.1};
  const auto one = parse_svg(render_loss_svg(step, loss));
  CHECK(polyline_points(one, "loss").size() == 1);
  CHECK(count_named(one, "circle") == 1);
  CHECK(has_text(one, "100"));  // a step axis around the one step
}

TEST_CASE("loss chart: log scale") {
  std::vector<std::int64_t> steps;
  std::vector<double> losses;
  for (int i = 0; i < 40; ++i) {
    steps.push_back(i * 10);
    losses.push_back(2.0 * std::pow(0.85, i));  // 2 down to ~3e-3
  }
  losses[5] = 0.0;
  losses[6] = -1.0;
  LossPlotOptions options;
  options.log_y = true;
  LossPlotSummary summary;
  const auto elements = parse_svg(render_loss_svg(steps, losses, options, &summary));
  CHECK(summary.skipped_non_positive == 2);
  CHECK(polyline_points(elements, "loss").size() == 38);
  CHECK(text_of_class(elements, "y-label") == "loss (log scale)");
  CHECK(text_of_class(elements, "note") == "2 non-positive points skipped (log scale)");
  for (const char* tick : {"0.001", "0.01", "0.1", "1", "10"}) CHECK_MESSAGE(has_text(elements, tick), tick);

  // Decades are evenly spaced on the axis.
  std::vector<double> tick_y;
  for (const Element& e : elements)
    if (e.name == "text" && (e.text == "0.01" || e.text == "0.1" || e.text == "1"))
      tick_y.push_back(std::stod(e.attributes.at("y")));
  REQUIRE(tick_y.size() == 3);
  CHECK(tick_y[0] - tick_y[1] == doctest::Approx(tick_y[1] - tick_y[2]).epsilon(0.01));
}

TEST_CASE("loss chart: long runs are decimated without losing spikes") {
  Series s = decaying(100000);
  s.losses[54321] = 3.0;  // one spike
  LossPlotOptions options;
  options.max_points = 1000;
  LossPlotSummary summary;
  const auto small = parse_svg(render_loss_svg(s.steps, s.losses, options, &summary));
  const auto points = polyline_points(small, "loss");
  CHECK(points.size() <= 1000);
  CHECK(points.size() > 900);
  CHECK(summary.polyline_points == points.size());
  CHECK(polyline_points(small, "ema").size() <= 1000);

  options.max_points = 1000000;
  const auto full = parse_svg(render_loss_svg(s.steps, s.losses, options));
  const auto all = polyline_points(full, "loss");
  CHECK(all.size() == 100000);
  auto top = [](const std::vector<Xy>& pts) {
    Xy best = pts[0];
    for (const Xy& p : pts) if (p.y < best.y) best = p;
    return best;
  };
  CHECK(top(points).x == top(all).x);  // the spike survives, at its step
  CHECK(top(points).y == top(all).y);
  CHECK(points.front().x == all.front().x);  // the line spans the whole run
  CHECK(points.back().x == all.back().x);
}

TEST_CASE("loss chart: written atomically; bad arguments rejected") {
  TempDir dir;
  const Series s = decaying(30);
  const auto path = dir / "loss.svg";
  const LossPlotSummary summary = write_loss_svg(path, s.steps, s.losses);
  CHECK(summary.plotted == 30);
  CHECK(read_text(path) == render_loss_svg(s.steps, s.losses));
  write_loss_svg(path, s.steps, s.losses);  // replaces
  CHECK(dir.entries() == std::vector<std::string>{"loss.svg"});
  CHECK_THROWS_AS(write_loss_svg(dir / "missing" / "loss.svg", s.steps, s.losses), zero::IoError);

  const std::vector<std::int64_t> two = {1, 2};
  const std::vector<double> three = {1.0, 2.0, 3.0};
  CHECK_THROWS_AS(render_loss_svg(two, three), zero::InvalidArgument);
  LossPlotOptions bad;
  bad.width = 10;
  CHECK_THROWS_AS(render_loss_svg(two, std::span<const double>(three).first(2), bad), zero::InvalidArgument);
  bad = {};
  bad.ema_smoothing = 1.0;
  CHECK_THROWS_AS(render_loss_svg(two, std::span<const double>(three).first(2), bad), zero::InvalidArgument);
}
