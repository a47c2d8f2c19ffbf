// build/report in a real browser: headless Chromium (Debian's `chromium`, which scripts/install-deps.sh installs)
// renders the report of a run with known metrics, a probe script asks the browser where each drawn point landed
// on the screen (getScreenCTM), and the screenshot must show each line's colour at those places. Together with
// tests/core/test_run_report.cpp (the drawn points are the metrics) this shows the plots a user sees are the
// metrics. Skipped, saying so, where chromium is not installed.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdlib>
#include <sstream>

#include "tests/core/report_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kReport = testing_util::build_dir() + "/report";

// An 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes), as RGB rows.
struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  const uint8_t* at(int x, int y) const { return &rgb[3 * (static_cast<size_t>(y) * width + x)]; }
};

uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

Image decode_png(const std::string& file) {
  const std::string bytes = read_file(file);
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() < 8 || bytes.compare(1, 3, "PNG") != 0) throw std::runtime_error(file + ": not a PNG");
  Image img;
  int channels = 0;
  std::string idat;
  for (size_t at = 8; at + 12 <= bytes.size();) {
    const uint32_t len = be32(p + at);
    const std::string type = bytes.substr(at + 4, 4);
    const uint8_t* data = p + at + 8;
    if (type == "IHDR") {
      img.width = static_cast<int>(be32(data)), img.height = static_cast<int>(be32(data + 4));
      if (data[8] != 8 || data[12] != 0 || (data[9] != 2 && data[9] != 6))
        throw std::runtime_error(file + ": expected an 8-bit non-interlaced RGB(A) PNG");
      channels = data[9] == 6 ? 4 : 3;
    } else if (type == "IDAT") {
      idat.append(reinterpret_cast<const char*>(data), len);
    }
    at += 12 + len;
  }
  const size_t stride = static_cast<size_t>(img.width) * channels;
  std::vector<uint8_t> raw((stride + 1) * img.height);
  uLongf raw_size = raw.size();
  if (uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(idat.data()), idat.size()) != Z_OK)
    throw std::runtime_error(file + ": IDAT does not inflate");
  std::vector<uint8_t> pixels(stride * img.height);
  for (int y = 0; y < img.height; y++) {
    const uint8_t filter = raw[y * (stride + 1)];
    const uint8_t* in = &raw[y * (stride + 1) + 1];
    uint8_t* out = &pixels[y * stride];
    const uint8_t* up = y > 0 ? &pixels[(y - 1) * stride] : nullptr;
    for (size_t i = 0; i < stride; i++) {
      const int a = i >= size_t(channels) ? out[i - channels] : 0, b = up ? up[i] : 0,
                c = up && i >= size_t(channels) ? up[i - channels] : 0;
      int pred = 0;
      switch (filter) {
        case 0: pred = 0; break;
        case 1: pred = a; break;
        case 2: pred = b; break;
        case 3: pred = (a + b) / 2; break;
        case 4: {
          const int pa = std::abs(b - c), pb = std::abs(a - c), pc = std::abs(a + b - 2 * c);
          pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
          break;
        }
        default: throw std::runtime_error(file + ": unknown PNG row filter");
      }
      out[i] = static_cast<uint8_t>(in[i] + pred);
    }
  }
  img.rgb.resize(size_t(3) * img.width * img.height);
  for (size_t i = 0; i < size_t(img.width) * img.height; i++)
    for (int k = 0; k < 3; k++) img.rgb[3 * i + k] = pixels[i * channels + k];
  return img;
}

// Whether a pixel within 2 of (x, y) has the colour (antialiased lines keep it near their middle).
bool colour_near(const Image& img, double x, double y, int r, int g, int b) {
  for (int dy = -2; dy <= 2; dy++)
    for (int dx = -2; dx <= 2; dx++) {
      const int px = static_cast<int>(std::lround(x)) + dx, py = static_cast<int>(std::lround(y)) + dy;
      if (px < 0 || py < 0 || px >= img.width || py >= img.height) continue;
      const uint8_t* c = img.at(px, py);
      if (std::abs(c[0] - r) + std::abs(c[1] - g) + std::abs(c[2] - b) < 90) return true;
    }
  return false;
}

// Appended to a copy of the report: the screen position of every drawn point of every line, as text.
constexpr const char* kProbe = R"(<script>
var out = [];
document.querySelectorAll('svg.plot').forEach(function (svg) {
  var m = svg.getScreenCTM(), title = svg.querySelector('.title').textContent;
  svg.querySelectorAll('polyline').forEach(function (line) {
    for (var i = 0; i < line.points.numberOfItems; i++) {
      var p = line.points.getItem(i);
      out.push(title + '|' + line.dataset.series + '|' + (p.x * m.a + m.e) + '|' + (p.y * m.d + m.f));
    }
  });
});
var pre = document.createElement('pre'); pre.id = 'positions'; pre.textContent = out.join('\n'); document.body.appendChild(pre);
</script>)";

bool have_chromium() { return std::system("command -v chromium > /dev/null 2>&1") == 0; }

TEST(Report, ChromiumDrawsTheMetricsWhereTheReportSays) {
  if (!have_chromium())
    GTEST_SKIP() << "chromium is not installed: scripts/install-deps.sh installs Debian's chromium, which this test "
                    "needs to render the report";
  TempDir tmp("report_browser");
  testing_util::write_known_run(tmp / "run", 100);
  auto r = run_command(kReport + " " + (tmp / "run").string() + " --no_refresh", tmp / "report.log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string html = read_file(tmp / "run" / "report.html");
  html.insert(html.rfind("</body>"), kProbe);
  std::ofstream(tmp / "probe.html") << html;

  const std::string chromium = "timeout 90 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars "
                               "--force-device-scale-factor=1 --window-size=1200,1800 --user-data-dir=" +
                               (tmp / "profile").string() + " ";
  const std::string url = "file://" + (tmp / "probe.html").string();
  r = run_command(chromium + "--dump-dom " + url + " 2>/dev/null", tmp / "dom.html");
  ASSERT_EQ(r.exit_code, 0) << r.output.substr(0, 2000);
  r = run_command(chromium + "--screenshot=" + (tmp / "shot.png").string() + " " + url, tmp / "shot.log");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  if (const char* keep = std::getenv("TUNA_KEEP_SCREENSHOT")) fs::copy_file(tmp / "shot.png", keep, fs::copy_options::overwrite_existing);

  const std::string dom = read_file(tmp / "dom.html");
  const size_t begin = dom.find("<pre id=\"positions\">"), end = dom.find("</pre>", begin);
  ASSERT_NE(begin, std::string::npos) << "the probe did not run: " << dom.substr(0, 2000);
  std::map<std::string, std::vector<std::pair<double, double>>> where;  // "plot|series" -> screen points
  std::istringstream lines(dom.substr(begin + 20, end - begin - 20));
  for (std::string line; std::getline(lines, line);) {
    const size_t a = line.find('|'), b = line.find('|', a + 1), c = line.find('|', b + 1);
    where[line.substr(0, b)].emplace_back(std::stod(line.substr(b + 1, c - b - 1)), std::stod(line.substr(c + 1)));
  }
  const Image shot = decode_png((tmp / "shot.png").string());
  ASSERT_EQ(shot.width, 1200);

  struct Line {
    const char* key;
    int r, g, b;
  };
  for (const Line& line : {Line{"Loss|train", 0x1f, 0x77, 0xb4}, Line{"Learning rate|lr", 0x2c, 0xa0, 0x2c},
                           Line{"Gradient norm (before clipping)|grad norm", 0x94, 0x67, 0xbd}}) {
    const auto& pts = where[line.key];
    ASSERT_EQ(pts.size(), 100u) << line.key;
    const bool norm = std::string(line.key).find("grad norm") != std::string::npos;
    int on = 0, off = 0, marked = 0, expected = 0;
    for (size_t i = 0; i < pts.size(); i++) {
      const auto [x, y] = pts[i];
      ASSERT_LT(y, shot.height) << line.key << ": drawn below the screenshot";
      if (norm && (i + 1) % 7 == 0) {  // a clipped step: the red mark covers the line there
        marked += colour_near(shot, x, y, 0xd6, 0x27, 0x28);
        continue;
      }
      expected++;
      on += colour_near(shot, x, y, line.r, line.g, line.b);
      off += colour_near(shot, x, y + 40, line.r, line.g, line.b);  // 40 px below the line: mostly not the line
    }
    EXPECT_GE(on, expected * 9 / 10) << line.key << ": the line's colour at only " << on << " of " << expected << " points";
    EXPECT_LE(off, expected * 3 / 10) << line.key << ": the colour is everywhere (" << off << " points 40 px off the line)";
    if (norm) {
      EXPECT_EQ(marked, 14) << "the 14 clipped steps are marked in red where their norm is drawn";
    }
  }
}

}  // namespace
}  // namespace tuna
